"""``sluice demo``: run the shipped trained model (or a large synthetic one) with an expert
cache that holds only a fraction of the experts, and print the streaming stats."""

from __future__ import annotations

import sys
from pathlib import Path

from .engine import ModelInfo, Options, load
from .resolve import DEMO_DIR
from .storage.store import user_cache_dir
from .synthetic import BASE_CONFIGS, DEMO_CONFIG, model_bytes, scaled_config, write_model
from .units import format_size

DEMO_VERSION = 1
# The trained demo model that ships inside the package (see docs/demo-model.md); `demo` names it.
SHIPPED_MODEL = DEMO_DIR
SHIPPED_PROMPT = "def fibonacci(n):\n"
SYNTHETIC_PROMPT = "The streaming engine reads only the experts each token needs, so"


def cache_root(cache_dir: str | None = None) -> Path:
    return Path(cache_dir) if cache_dir else user_cache_dir()


SMALL_DEMO = {
    **DEMO_CONFIG, "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1408, "moe_intermediate_size": 256,
    "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
}


# ``--family``: the synthetic model's shape (``synthetic.BASE_CONFIGS``), by name
FAMILY_NAMES = {"qwen3_moe": "Qwen3-MoE", "mixtral": "Mixtral", "deepseek_v4": "DeepSeek-V4",
                "qwen4_exp": "Qwen3.8-Flash-Next"}


def demo_config(size: int, family: str = "qwen3_moe") -> dict:
    """The demo's shape of ``family`` for a target size (its expert count scaled); Qwen3-MoE's is
    a narrower one below 1 GB."""
    if family not in FAMILY_NAMES:
        from .errors import InvalidArgumentError

        raise InvalidArgumentError(f"--family {family!r}: expected one of {', '.join(FAMILY_NAMES)}")
    if family == "qwen3_moe":
        return scaled_config(size, DEMO_CONFIG if size >= 1e9 else SMALL_DEMO)
    return scaled_config(size, BASE_CONFIGS[family])


def shipped_model() -> Path:
    """The trained demo checkpoint, or a clear error if the installation lacks it."""
    if not (SHIPPED_MODEL / "config.json").is_file() or not (SHIPPED_MODEL / "model.safetensors").is_file():
        from .errors import SluiceError

        raise SluiceError(f"the trained demo model is missing from {SHIPPED_MODEL}; reinstall sluice, "
                          "or run the scale demo on random weights with: sluice demo --synthetic 2GB")
    return SHIPPED_MODEL


def ensure_synthetic(size: int, cache_dir: str | None = None, progress: bool = True,
                     family: str = "qwen3_moe") -> Path:
    """The synthetic demo checkpoint of ``family``'s shape of about ``size`` bytes, written once
    into the cache dir."""
    cfg = demo_config(size, family)
    path = cache_root(cache_dir) / f"synthetic-{family}-{size / 1e9:.1f}GB-v{DEMO_VERSION}"
    if not (path / "config.json").exists():
        print(f"[sluice demo] writing a {model_bytes(cfg) / 1e9:.2f} GB synthetic {FAMILY_NAMES[family]} checkpoint "
              f"(random weights) to {path} (once)", file=sys.stderr)
        write_model(path, cfg, progress=progress)
    return path


def demo_cache(path: Path, share: float = 0.25, parallel: int = 1) -> tuple[int, int]:
    """Expert-cache slots holding ``share`` of all experts (at least one token's working set),
    and the smallest budget that gives them with ``parallel`` sequences' state: well under the
    model size."""
    info = ModelInfo(path)
    slots = max(info.desc.working_set, int(share * info.desc.total_experts))
    plan = info.plan(1 << 40, Options(cache_experts=info.desc.top_k, parallel=parallel))
    info.checkpoint.close()
    return slots, plan.budget_for_slots(slots)


def run_demo(args, options: dict, generate_and_print) -> int:
    """``sluice demo``: ``options`` are the engine options from the command line;
    ``generate_and_print(engine, prompt, args)`` is the CLI's streaming printer (passed in, as
    the faces below the CLI never import it)."""
    options = dict(options, parallel=options.get("parallel") or 1)  # the demo runs one sequence
    if args.synthetic is None:
        path = shipped_model()
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        slots, budget = demo_cache(path, parallel=options["parallel"])
        if args.memory is None and options["cache_experts"] is None:
            # exactly a quarter of the experts; headroom for the baseline measured again at load
            # (a few MiB higher once more is imported)
            options["cache_experts"] = slots
        budget = args.memory or budget + (32 << 20)
        prompt = args.prompt if args.prompt is not None else SHIPPED_PROMPT
        engine = load(path, memory=budget, **options)
        intro = (f"[sluice demo] the shipped demo model ({format_size(size)}, trained on Python's standard library; "
                 f"docs/demo-model.md) with an expert cache of {engine.plan.cache_slots} of "
                 f"{engine.plan.total_experts} experts: the others are read from disk when a token is routed to them.")
        echo = None if args.json else prompt
    else:
        path = ensure_synthetic(args.synthetic, args.cache_dir, progress=not args.no_progress,
                                family=getattr(args, "family", "qwen3_moe"))
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        budget = args.memory or demo_cache(path, parallel=options["parallel"])[1]
        prompt = args.prompt if args.prompt is not None else SYNTHETIC_PROMPT
        print(f"[sluice demo] model {format_size(size)} on disk, memory budget {format_size(budget)} "
              f"({100 * budget / size:.0f}% of the model). Random weights: the text is meaningless; "
              "the streaming numbers are the point.", file=sys.stderr)
        engine = load(path, memory=budget, **options)
        intro, echo = None, None
    with engine:  # closed however the run ends (an error, ^C)
        if intro is not None:
            print(intro, file=sys.stderr)
        rc = generate_and_print(engine, prompt, args, echo=echo)
        if not args.json:
            print(plan_summary(engine.plan, "demo" if args.synthetic is None else str(path)), file=sys.stderr)
    return rc


def plan_summary(plan, model: str) -> str:
    """The demo's closing line: what the budget bought, in words."""
    return (f"[sluice demo] memory budget {format_size(plan.budget)} (the model's floor is "
            f"{format_size(plan.floor)}): an expert cache of {plan.cache_slots} of {plan.total_experts} experts "
            f"({100 * plan.cache_slots / max(plan.total_experts, 1):.0f}%). `sluice inspect {model}` shows what "
            "other budgets buy.")
