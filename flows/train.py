r"""The training flow: the RL step loop, one task per stage.

    prompts -> trees -> prefix cache -> policy update
                                     \-> drafter distillation
"""

from __future__ import annotations

from prefect import flow, get_run_logger

from lsreplay.config import load_config
from lsreplay.metrics import step_record
from lsreplay.run import Run
from tasks.pool import ensure_pool
from tasks.stages import cache_prefixes, distill_drafter, generate_trees, sample_prompts, train_policy


@flow(name="lsreplay-train")
def train(config_path: str | None = None, overrides: list[str] | None = None, force: bool = False) -> list[dict]:
    """Run (or resume) the configured number of RL steps; returns the per-step metrics."""
    cfg = load_config(config_path, overrides or [])
    logger = get_run_logger()
    run = Run(cfg)
    run.save_or_check_config(force=force)
    ensure_pool(cfg.pool)
    logger.info("run %s: %d steps, storage %s", cfg.run_dir, cfg.steps, run.store.uri)
    for step in range(cfg.steps):
        manifests = {"prompts": sample_prompts(cfg, step)}
        manifests["trees"] = generate_trees(cfg, step)
        manifests["prefixes"] = cache_prefixes(cfg, step)
        manifests["policy"] = train_policy(cfg, step)
        if cfg.drafter.enabled:
            manifests["drafter"] = distill_drafter(cfg, step)
        record = step_record(step, manifests)
        run.append_metrics(record)
        logger.info("step %d: %s", step, ", ".join(f"{k}={v:.4g}" for k, v in record.items()
                                                    if isinstance(v, float)))
    return run.metrics()
