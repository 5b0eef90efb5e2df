"""Which chat format suits the demo model: candidate prompt layouts compared on the same requests.

    python benchmarks/demo_chat_templates.py [--tokens 120] [--show]

The demo model completes Python; it was never trained to chat. Each design below turns a
request into a Python prompt whose continuation is the reply. Greedy replies (up to --tokens)
are cut at the demo's chat stop strings (a line starting in column 0); the table counts the
replies that ended there rather than at the token limit, and their total length. --show prints
every reply. The shipped template (src/sluice/demo_model/chat_template.jinja) is design G8; its
own row renders the requests with it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import sluice  # noqa: E402

REQUESTS = ["Read a file and return its lines", "How do I reverse a list?", "hello",
            "Write a function that adds two numbers", "Sort a dictionary by value", "What is the capital of France?",
            "Check whether a path exists", "Parse a date string"]


def doc(u: str) -> str:
    return u.rstrip("?.!") + "."


def snake(u: str) -> str:
    return "_".join(re.findall(r"[a-z0-9]+", u.lower())[:6])


DESIGNS = {
    "G0 comment, def answer()": lambda u: f'# {u}\n\n\ndef answer():\n    """{doc(u)}"""\n    ',
    "G1 def answer(), no comment": lambda u: f'def answer():\n    """{doc(u)}"""\n    ',
    "G2 function named after the request": lambda u: f'def {snake(u)}():\n    """{doc(u)}"""\n    ',
    "G3 comment, function named after it": lambda u: f'# {u}\n\n\ndef {snake(u)}():\n    """{doc(u)}"""\n    ',
    "G4 answer(question), 'Return the answer.'":
        lambda u: f'\n\n\ndef answer(question):\n    """{doc(u)}\n\n    Return the answer.\n    """\n    ',
    "G5 comment, def answer(question)": lambda u: f'# {u}\n\n\ndef answer(question):\n    """{doc(u)}"""\n    ',
    "G6 '# Question:' comment, def answer()":
        lambda u: f'# Question: {u}\n\n\ndef answer():\n    """{doc(u)}"""\n    ',
    "G7 comment, def solution(), long docstring":
        lambda u: f'# {u}\n\n\ndef solution():\n    """{doc(u)}\n    """\n    ',
    "G8 comment, def answer(*args)": lambda u: f'# {u}\n\n\ndef answer(*args):\n    """{doc(u)}"""\n    ',
    # the shipped template itself (G8, the indentation left to the model)
    "shipped chat_template.jinja": None,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=120)
    ap.add_argument("--show", action="store_true", help="print every prompt and reply")
    args = ap.parse_args()
    eng = sluice.load("demo", memory="2GiB", threads=1, progress=False)
    stops = eng.tokenizer.chat_stop_strings
    print(f"{'design':<45} {'ended in a function':>20} {'tokens':>7}")
    for name, make in DESIGNS.items():
        if make is None:
            def make(u):
                return eng.tokenizer.render_chat([{"role": "user", "content": u}])
        ended = tokens = 0
        for u in REQUESTS:
            r = eng.generate(make(u), max_new_tokens=args.tokens, stop=stops)
            ended += r.finish_reason == "stop"
            tokens += len(r.token_ids)
            if args.show:
                print(f"--- {name}: {r.finish_reason}, {len(r.token_ids)} tokens\n{make(u)}{r.text}")
        print(f"{name:<45} {ended:>17}/{len(REQUESTS)} {tokens:>7}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
