"""transformers (+ accelerate disk offload under a cap) arm: greedy ``generate`` with a streamer.

With ``--memory``, weights beyond ``max_memory={"cpu": share * cap}`` are offloaded to
``--scratch`` (accelerate's ``offload_folder``) and loaded module by module during the
forward; without it the whole model is loaded in RAM. ``--option dtype="float32"`` upcasts
(the reference the other engines are compared with); the default is the checkpoint's dtype.
"""

from __future__ import annotations

import common


def main() -> None:
    args = common.parser(__doc__).parse_args()
    opts = common.options(args)
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(args.threads)
    ids = common.ids(args)
    kw = {}
    dtype = opts.get("dtype", "auto")
    kw["dtype"] = getattr(torch, dtype) if dtype != "auto" else "auto"
    if args.memory:
        share = float(opts.get("cpu_share", 0.4))
        kw.update(device_map="auto", max_memory={"cpu": int(share * args.memory)}, offload_folder=args.scratch,
                  offload_buffers=True)
    model = AutoModelForCausalLM.from_pretrained(args.model, **kw).eval()
    placement = {}
    for dev in (getattr(model, "hf_device_map", None) or {}).values():
        placement[str(dev)] = placement.get(str(dev), 0) + 1
    gen = model.generation_config
    gen.eos_token_id = None  # like --ignore-eos: always generate new_tokens greedy tokens
    gen.pad_token_id = gen.pad_token_id if gen.pad_token_id is not None else 0
    x = torch.tensor([ids])

    def generate(streamer=None):
        with torch.inference_mode():
            return model.generate(x, max_new_tokens=args.new_tokens, do_sample=False, streamer=streamer,
                                  generation_config=gen)

    if args.warmup:
        generate()
    common.mark("loaded")

    class Stream(BaseStreamer):
        def __init__(self):
            self.clock = common.Clock()
            self.prompt_seen = False

        def put(self, value):
            if not self.prompt_seen:  # the first call carries the prompt
                self.prompt_seen = True
                return
            for t in value.reshape(-1).tolist():
                self.clock.token(t)

        def end(self):
            pass

    s = Stream()
    common.profiled(args.profile, lambda: generate(s))
    out = s.clock.summary(len(ids))
    if opts.get("margins"):
        # top-1 minus top-2 logit at every generated position: how decisive the reference is
        seq = torch.tensor([ids + out["token_ids"]])
        with torch.inference_mode():
            logits = model(seq).logits[0, len(ids) - 1 : -1].float()
        top = logits.topk(2, dim=-1).values
        out["logit_margins"] = (top[:, 0] - top[:, 1]).tolist()
    out.update(placement=placement, dtype=str(next(model.parameters()).dtype))
    common.finish(out)


if __name__ == "__main__":
    main()
