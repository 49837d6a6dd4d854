from hyperpipe.cli import main

raise SystemExit(main())
