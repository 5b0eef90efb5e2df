"""Sluice arm: ``sluice.load`` under the cap as its budget, greedy, no speculation by default."""

from __future__ import annotations

import common


def main() -> None:
    args = common.parser(__doc__).parse_args()
    opts = common.options(args)
    speculate = bool(opts.pop("speculate", False))
    warmup_ids = opts.pop("warmup_ids", None)
    import sluice

    ids = common.ids(args)
    ctx = opts.pop("max_context", max(256, len(ids) + args.new_tokens + 16))
    opts.setdefault("parallel", 1)  # one stream: no state slots for others (they would take expert cache)
    engine = sluice.load(args.model, memory=args.memory, threads=args.threads, max_context=ctx, progress=False,
                         **opts)
    warm = None
    if args.warmup:
        warm = engine.generate(warmup_ids or ids, max_new_tokens=args.new_tokens, ignore_eos=True,
                               speculate=speculate).stats
    common.mark("loaded")

    def run():
        clock = common.Clock()
        stats = {}
        for step in engine.stream(ids, max_new_tokens=args.new_tokens, ignore_eos=True, speculate=speculate):
            clock.token(step.token_id)
            if step.finish_reason:
                stats = step.stats
        return clock, stats

    clock, stats = common.profiled(args.profile, run)
    out = clock.summary(len(ids))
    out.update(engine_stats=stats, warmup_stats=warm, plan=engine.plan.to_dict(), load_s=engine.load_s,
               speculate=speculate)
    common.finish(out)


if __name__ == "__main__":
    main()
