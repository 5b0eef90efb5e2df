"""AirLLM arm (on CPU): layer-by-layer streaming of a fused-key checkpoint, greedy ``generate``.

``--model`` is the fused-key directory written by ``make_model.py airllm``; AirLLM links its
per-layer shards into ``--scratch`` (its ``layer_shards_saving_path``) on first use.
"""

from __future__ import annotations

import common


def main() -> None:
    args = common.parser(__doc__).parse_args()
    opts = common.options(args)
    import torch
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(args.threads)
    from airllm import AutoModel

    ids = common.ids(args)
    dtype = getattr(torch, opts["dtype"]) if opts.get("dtype") else None  # None: the checkpoint's
    model = AutoModel.from_pretrained(args.model, device="cpu", dtype=dtype, layer_shards_saving_path=args.scratch,
                                      max_seq_len=max(128, len(ids) + args.new_tokens + 8),
                                      prefetching=bool(opts.get("prefetching", True)))
    gen = model.model.generation_config
    gen.eos_token_id = None
    gen.pad_token_id = 0
    x = torch.tensor([ids])

    def generate(streamer=None):
        with torch.inference_mode():
            return model.generate(x, max_new_tokens=args.new_tokens, do_sample=False, use_cache=True,
                                  streamer=streamer, generation_config=gen)

    if args.warmup:
        generate()
    common.mark("loaded")

    class Stream(BaseStreamer):
        def __init__(self):
            self.clock = common.Clock()
            self.prompt_seen = False

        def put(self, value):
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            for t in value.reshape(-1).tolist():
                self.clock.token(t)

        def end(self):
            pass

    s = Stream()
    common.profiled(args.profile, lambda: generate(s))
    common.finish(s.clock.summary(len(ids)))


if __name__ == "__main__":
    main()
