"""llama.cpp arm (llama-cpp-python): the GGUF file memory-mapped (llama.cpp's default), greedy.

Token ids go in directly (no tokenizer, no BOS added), so every engine sees the same prompt.
"""

from __future__ import annotations

import common


def main() -> None:
    args = common.parser(__doc__).parse_args()
    opts = common.options(args)
    from llama_cpp import Llama

    ids = common.ids(args)
    kw = {}
    if opts.get("kv_type") == "f32":  # llama.cpp's KV cache is f16 by default; f32 for exactness checks
        import llama_cpp

        kw.update(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    llm = Llama(model_path=args.model, n_ctx=int(opts.get("n_ctx", max(256, len(ids) + args.new_tokens + 16))),
                n_threads=args.threads, n_threads_batch=args.threads, n_batch=512,
                use_mmap=bool(opts.get("use_mmap", True)), use_mlock=False, verbose=False, **kw)

    def generate(clock=None):
        # llama-cpp-python reuses the KV cache of a previous call whose tokens share a prefix
        # with this prompt; reset() makes every run prefill its whole prompt like the others
        llm.reset()
        n = 0
        for tok in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
            if clock is not None:
                clock.token(tok)
            n += 1
            if n >= args.new_tokens:
                break

    if args.warmup:
        generate()
    common.mark("loaded")
    clock = common.Clock()
    common.profiled(args.profile, lambda: generate(clock))
    common.finish(clock.summary(len(ids)))


if __name__ == "__main__":
    main()
