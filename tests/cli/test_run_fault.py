"""`hyperpipe run --inject-fault`: a fault step the run will never reach is bad input."""

from __future__ import annotations

import json

from factories import chain_plan

from hyperpipe.cli import main
from hyperpipe.exec import checkpoint


def test_a_fault_before_the_resume_point_is_refused_naming_the_first_step(tmp_path,
                                                                            capsys):
    """Resuming a 2-step checkpoint runs steps 2 and 3: a fault at step 1 would never be
    injected (the run had exited 0). Refused with exit 2 before any rank starts, naming
    --inject-fault and step 2."""
    plan = chain_plan("tiny-gpt", "demo-hetero", [0, 4, 8], ["a100/0", "v100/0"], 2, 2)
    (tmp_path / "plan.json").write_text(json.dumps(plan.to_dict()))
    ck = tmp_path / "ck"
    checkpoint.step_dir(ck, 2).mkdir(parents=True)
    (checkpoint.step_dir(ck, 2) / checkpoint.MANIFEST).write_text("{}")  # complete
    rc = main(["run", "--plan", str(tmp_path / "plan.json"), "--steps", "4", "--checkpoint",
               str(ck), "--resume", "--inject-fault", "0:1", "--no-memory-check"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "--inject-fault" in err[0] and "from 2" in err[0] and "'0:1'" in err[0]
