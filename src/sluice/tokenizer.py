"""Tokenizer and chat template of a model directory (``tokenizers`` + ``jinja2``, no transformers).

The files come through the storage seam (a ``Store``): the JSON and template files are read
by name, and ``tokenizer.json`` is handed to the tokenizer library as the local file the
store provides (the file itself for a local directory)."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from .chat_template import special_tokens
from .errors import ChatTemplateError, CheckpointError
from .storage import Store, open_store
from .storage.jsonfile import read_json


def _json_kind(v) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(v), "number")


# a remote tokenizer.json larger than this is refused (the largest published ones are ~30 MB)
TOKENIZER_MAX_BYTES = 256 << 20


def has_tokenizer(store: Store) -> bool:
    """The directory has a ``tokenizer.json``: a file, or something else under its name (which
    ``Tokenizer`` refuses by name rather than reading the model as having no tokenizer)."""
    return store.exists("tokenizer.json") or store.not_regular("tokenizer.json") is not None


class Tokenizer:
    def __init__(self, directory: str | Path | Store):
        store = directory if isinstance(directory, Store) else open_store(directory)
        path = store.locate("tokenizer.json")
        what = store.not_regular("tokenizer.json")
        if what is not None:  # never opened: a FIFO would block the tokenizer library until a writer came
            raise CheckpointError(f"{path}: cannot load the tokenizer: tokenizer.json is {what}, not a regular file")
        if not store.exists("tokenizer.json"):
            raise CheckpointError(f"{path}: tokenizer.json not found (pass token ids instead of text)")
        try:
            local = store.local_path("tokenizer.json")
            if local is not None:
                self._tok = _HFTokenizer.from_file(str(local))
            else:  # a remote store: its bytes (kept in the metadata cache, no copy of its own)
                text = store.read_bytes("tokenizer.json", TOKENIZER_MAX_BYTES).decode("utf-8")
                self._tok = _HFTokenizer.from_str(text)
        except Exception as e:  # tokenizers raises its own exception types
            raise CheckpointError(f"{path}: cannot load tokenizer ({e})") from None
        cfg_path = store.locate("tokenizer_config.json")
        self.config: dict = {}
        if store.exists("tokenizer_config.json"):
            try:
                self.config = read_json(store, "tokenizer_config.json")  # size-capped, depth-checked
            except OSError as e:
                raise CheckpointError(f"{cfg_path}: cannot read ({e.strerror or e})") from None
            if not isinstance(self.config, dict):
                raise CheckpointError(f"{cfg_path}: must be a JSON object, got a JSON {_json_kind(self.config)}")
        # As transformers does: a chat_template.jinja file wins over "chat_template" in
        # tokenizer_config.json (a string, or a list of named templates of which "default" is used).
        self.chat_template = self.config.get("chat_template")
        if store.exists("chat_template.jinja"):
            try:
                self.chat_template = store.read_text("chat_template.jinja")
            except UnicodeDecodeError as e:
                raise CheckpointError(f"{store.locate('chat_template.jinja')}: not UTF-8 text ({e})") from None
        if isinstance(self.chat_template, list):  # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in self.chat_template if isinstance(t, dict)}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        if self.chat_template is not None and not isinstance(self.chat_template, str):
            raise CheckpointError(f"{cfg_path}: chat_template must be a string (or a list of named templates), got "
                                  f"a JSON {_json_kind(self.chat_template)}")
        # Text that ends an assistant reply in this chat format, for models whose replies do not
        # end with an end-of-sequence token (the demo model). Chat generation stops there.
        stops = self.config.get("chat_stop_strings", [])
        if not isinstance(stops, list) or not all(isinstance(x, str) and x for x in stops):
            raise CheckpointError(f"{cfg_path}: chat_stop_strings must be a list of non-empty strings")
        self.chat_stop_strings: list[str] = stops
        special = special_tokens(self.config)
        self.bos_token = special.get("bos_token")
        self.eos_token = special.get("eos_token")
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos_token = bool(self.config.get("add_bos_token", False))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: seconds for a long text)
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render ``messages`` with the model's own chat template (as transformers does)."""
        if not self.chat_template:
            raise CheckpointError("this model has no chat template (tokenizer_config.json has no chat_template)")
        from .chat_template import compile_template, render

        import jinja2

        try:
            template = compile_template(self.chat_template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(f"the model's chat template has a syntax error at line {e.lineno}: {e.message}") \
                from None
        try:
            return render(template, messages, add_generation_prompt, special_tokens(self.config))
        except jinja2.exceptions.TemplateError as e:  # undefined names, raise_exception(), sandbox refusals
            raise ChatTemplateError(f"the model's chat template failed: {type(e).__name__}: {e}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError, OverflowError,
                RecursionError) as e:  # Python errors inside template expressions
            raise ChatTemplateError(f"the model's chat template failed: {type(e).__name__}: {e}") from None
