"""A user's framework job read into a plan (``hyperpipe import``).

`import_plan` reads the job with its framework's reader (`megatron.read_megatron`,
`torchtitan.read_torchtitan`, `deepspeed.read_deepspeed`), places it on the cluster in
the framework's rank order (`job.plan_of`) and returns the plan with the notes: what
was not read, what was assumed where the job is silent, and what the plan approximates.
Settings the import does not read yet (mixture-of-experts) refuse it with BadInput
(exit 2); context parallelism imports as every stage's `cp`, ZeRO-2/3 and FSDP as the
plan's `zero` 2 or 3.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from hyperpipe.cluster.cluster import Cluster
from hyperpipe.core.errors import BadInput
from hyperpipe.core.files import read_text
from hyperpipe.frameworks.job import FRAMEWORKS, Job, Notes, plan_of
from hyperpipe.plan.plan import Plan


def read_job(framework: str, path: str | Path, *, args: str | Path | None = None,
             model: Any = None) -> Job:
    """The job in `path` (DeepSpeed: the JSON, with launch arguments in `args`); `model`
    (a preset name, file or document) replaces the model the job describes, keeping its
    block count (BadInput otherwise) and the precision the job trains it in
    (`Job.precision`)."""
    job = _read(framework, path, args, None if model is None else _spec(model))
    if model is None:
        return job
    spec = _spec(model)
    doc = spec.to_dict()
    if job.model and (job.model.get("n_layer") != doc.get("n_layer")):
        raise BadInput("--model", f"a model of the job's {job.model.get('n_layer')} blocks",
                       doc.get("n_layer"))
    if job.model:
        job.notes.assumed.append(f"model {spec.name} given with --model, in place of the "
                                 "job's own")
    return replace(job, model={**doc, **job.precision})


def _spec(model: Any):
    from hyperpipe.models import load_model
    spec = load_model(model, where="--model")
    if spec.config is None:
        raise BadInput("--model", "a GPT-style model (the frameworks build those)",
                       spec.name)
    return spec


def _read(framework: str, path: str | Path, args: str | Path | None, spec) -> Job:
    if framework not in FRAMEWORKS:
        raise BadInput("--from", f"one of {', '.join(FRAMEWORKS)}", framework)
    if args is not None and framework != "deepspeed":
        raise BadInput("--args", "only with --from deepspeed (the others' files hold their "
                       "launch arguments)", str(args))
    if framework == "megatron":
        from hyperpipe.frameworks.megatron import read_megatron
        return read_megatron(read_text(path), str(path))
    if framework == "torchtitan":
        from hyperpipe.frameworks.torchtitan import read_torchtitan
        return read_torchtitan(path, n_layer=None if spec is None else spec.config.n_layer)
    from hyperpipe.frameworks.deepspeed import read_deepspeed
    return read_deepspeed(path, args)


def import_plan(framework: str, path: str | Path, cluster: Cluster, *,
                args: str | Path | None = None, model: Any = None) -> tuple[Plan, Notes]:
    """The plan that runs the job in `path` on `cluster` (`read_job`), and what the
    import says."""
    job = read_job(framework, path, args=args, model=model)
    return plan_of(job, cluster), job.notes
