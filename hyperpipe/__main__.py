from hyperpipe.core import stopping

stopping.install()        # before the heavy imports: a signal during them is not lost

from hyperpipe.cli import main  # noqa: E402

raise SystemExit(main())
