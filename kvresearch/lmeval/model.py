r"""The lm-eval model ``kvresearch``: every lm-eval task answered from a compressed KV cache.

How a request meets the method:

* **Document and query.** A request's context is cut at the last ``document_split`` marker (default
  ``"\n\nQuestion:"``): the tokens before it are the document, compressed once by the method and shared
  by every request with the same document (the query-agnostic protocol of the evaluate stage); the rest
  of the context is fed after the compressed document. Without the marker the document is the whole
  context but its last token. ``query_aware=true`` compresses the whole context but its last token, once
  per distinct context. The cut is made on the request's own tokens, so the model sees exactly the token
  sequence lm-eval's HF model sees.
* **loglikelihood**: the continuation's log-probability and greedy flag, in one forward pass of the rest
  of the context and the continuation after the compressed document.
* **generate_until**: generation after the compressed document and the rest of the context, with the
  method's compression while decoding (``decode_context``); stop strings and ``max_gen_toks`` as lm-eval
  passes them, sampling when ``do_sample`` (seeded per request).
* **loglikelihood_rolling**: lm-eval's rolling windows, each teacher-forced one token at a time through
  the method's compression while decoding (a method that compresses only a prefilled context scores the
  document as the full cache does, in one forward pass).

Contexts longer than ``max_length`` are cut from the left, as lm-eval's HF model cuts them, but once per
document (by what its longest request needs), so that its requests still share one compressed cache.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from tqdm import tqdm

from kvresearch.errors import KVResearchError
from kvresearch.generation import Sampling
from kvresearch.methods.base import Method
from kvresearch.models import ModelAdapter, Session, load_model
from kvresearch.models.cache import RaggedCache
from kvresearch.prompts import Prompt
from kvresearch.runs import build, compose_config

DOCUMENT_SPLIT = "\n\nQuestion:"
_OWN_ARGS = {"query_aware", "document_split", "max_length", "seed"}  # the model's own options


@dataclass
class Request:
    """One request as token ids: ``doc`` is compressed, ``rest`` (>= 1 token) is fed after it."""

    index: int
    doc: tuple[int, ...]
    rest: list[int]


def split_ids(context_ids: Sequence[int], doc_ids: Sequence[int]) -> int:
    """How many leading tokens of ``context_ids`` form the document.

    The common prefix with ``doc_ids``, leaving at least one context token to feed after it.
    """
    n = 0
    for a, b in zip(context_ids, doc_ids, strict=False):
        if a != b:
            break
        n += 1
    return max(0, min(n, len(context_ids) - 1))


@register_model("kvresearch")
class KVResearchLM(TemplateLM):
    """A kvresearch model and method behind lm-eval's model interface (see the module docstring)."""

    def __init__(
        self,
        session: Session,
        method: Method,
        query_aware: bool = False,
        document_split: str | None = DOCUMENT_SPLIT,
        max_length: int | None = None,
        seed: int = 0,
    ):
        super().__init__()
        self.session, self.method = session, method
        self.tokenizer = session.tokenizer
        self.query_aware, self.document_split, self.seed = query_aware, document_split, seed
        self._max_length = max_length
        self.compressions = 0  # documents compressed so far (requests that shared one count once)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> KVResearchLM:
        """Build from ``model=<conf/model name>,method=<conf/method name>,<option>=<value>,...`` (see from_options)."""
        return cls.from_options(**lm_utils.simple_parse_args_string(arg_string))

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict[str, Any], additional_config: dict | None = None) -> KVResearchLM:
        """The same from a dict (what lm-eval's command line passes).

        lm-eval's ``additional_config`` is not used: requests run one at a time (no batch size), and its
        ``--device`` defaults to ``cuda:0``; the device is the model config's, or ``device=`` in the arguments.
        """
        return cls.from_options(**arg_dict)

    @classmethod
    def from_options(cls, model: str = "smollm2_135m", method: str = "full", **options: Any) -> KVResearchLM:
        """Compose ``conf/lm_eval.yaml`` with ``model`` and ``method``, load them, and wrap them.

        Other keys: this class's options, ``device``, ``model.<key>`` overrides, and method options
        (``threshold=-4`` or ``method.threshold=-4``).
        """
        own = {k: options.pop(k) for k in list(options) if k in _OWN_ARGS}
        device = options.pop("device", None)
        overrides = [f"model={model}", f"method={method}"] + [f"model.device={device}"] * bool(device)
        for key, value in options.items():
            name = key if key.startswith(("model.", "method.")) else f"method.{key}"
            overrides.append(f"{name}={'null' if value is None else value}")
        cfg = compose_config("lm_eval", overrides)
        built = build(cfg.method)
        loaded = load_model(cfg.model)
        return cls(Session(ModelAdapter(loaded.model), loaded.tokenizer), built, **own)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records in its results' config: the model and the method with its options."""
        return {
            "kvresearch_model": str(self.tokenizer.name_or_path),
            "kvresearch_method": self.method.describe(),
            "query_aware": self.query_aware,
            "document_split": self.document_split,
        }

    # --- lm-eval's model interface -----------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        """The end-of-text id: lm-eval's stop string for generations."""
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """What lm-eval puts before an empty context and each rolling window: BOS if any, else end of text."""
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        """Longest context + continuation, from the model's config unless set."""
        return self._max_length or resolve_max_length(self.session.model.config, self.tokenizer)

    @property
    def tokenizer_name(self) -> str:
        """Names the chat template in lm-eval's cache keys."""
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template (with the model config's template options)."""
        return str(
            self.tokenizer.apply_chat_template(
                chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids as lm-eval's HF model makes them (the tokenizer's default special tokens)."""
        extra = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        return list(self.tokenizer.encode(string, **extra))

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        """(log-probability, greedy) of each continuation after its context, documents compressed once."""
        out: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        items = [self._request(i, context, ids) for i, ((context, _), ids, _) in enumerate(requests)]
        continuations = [continuation for _, _, continuation in requests]
        # lm-eval scores at most max_length + 1 tokens of context and continuation together
        items = self._fit(items, [self.max_length + 1 - len(c) for c in continuations])
        bar = tqdm(total=len(items), desc="kvresearch loglikelihood", disable=disable_tqdm)
        for request, cache in self._compressed(items):
            out[request.index] = self._score(cache, request.rest, continuations[request.index])
            bar.update(1)
        bar.close()
        return out

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        """Sum of the log-probabilities of each document's tokens over lm-eval's rolling windows."""
        totals = []
        for (string,) in tqdm([r.args for r in requests], desc="kvresearch rolling", disable=disable_tqdm):
            windows = lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            total = 0.0
            for context, continuation in map(lm_utils.make_disjoint_window, windows):
                cache = self.session.new_cache()
                total += self._score(cache, list(context), list(continuation), through_decoding=True)[0]
            totals.append(total)
        return totals

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Generations after each context, documents compressed once, stopped at lm-eval's stop strings."""
        eos = self.tokenizer.decode([self.eot_token_id])
        settings = []
        items = []
        for i, (context, gen_kwargs) in enumerate(r.args for r in requests):
            kwargs = dict(normalize_gen_kwargs(gen_kwargs, 256))
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_new = int(kwargs.pop("max_gen_toks"))
            sampling = Sampling(
                temperature=float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                top_p=float(kwargs.get("top_p") or 1.0),
                top_k=int(kwargs.get("top_k") or 0),
                seed=self.seed + i,
            )
            settings.append((until, max_new, sampling))
            items.append(self._request(i, context, self.tok_encode(context)))
        items = self._fit(items, [self.max_length - max_new for _, max_new, _ in settings])
        out = [""] * len(items)
        bar = tqdm(total=len(items), desc="kvresearch generate_until", disable=disable_tqdm)
        for request, cache in self._compressed(items):
            until, max_new, sampling = settings[request.index]
            generated = self.session.generate(
                cache,
                torch.tensor([request.rest]),
                max_new,
                sampling,
                decode_context=lambda c: self.method.decode_context(self.session, c),
                stop=[s for s in until if s],
            )
            text = self.tokenizer.decode(generated.tokens, skip_special_tokens=True)
            out[request.index] = postprocess_generated_text(text, until, None)
            bar.update(1)
        bar.close()
        return out

    # --- compression ---------------------------------------------------------------------------------------

    def _request(self, index: int, context: str, context_ids: list[int]) -> Request:
        """Cut ``context_ids`` into the document to compress and the rest (see the module docstring)."""
        at = -1 if self.query_aware or not self.document_split else context.rfind(self.document_split)
        n = split_ids(context_ids, self.tok_encode(context[:at])) if at > 0 else len(context_ids) - 1
        return Request(index, tuple(context_ids[:n]), list(context_ids[n:]))

    def _fit(self, requests: list[Request], budgets: list[int]) -> list[Request]:
        """Cut documents from the left so that each request's context fits its budget (tokens).

        A document is cut once, by as much as its longest request needs, so that its requests still share
        one compressed cache (lm-eval's HF model cuts each request on its own, by what that request needs).
        """
        overflow: dict[tuple[int, ...], int] = {}
        for request in requests:
            over = len(request.doc) + len(request.rest) - budgets[request.index]
            overflow[request.doc] = max(overflow.get(request.doc, 0), over)
        fitted = []
        for request in requests:
            cut = overflow[request.doc]
            if cut > len(request.doc):
                raise KVResearchError(
                    f"request {request.index}: {len(request.rest)} tokens after the document and "
                    f"{len(request.doc)} in it do not fit max_length={self.max_length} with the continuation or "
                    "generation length: raise max_length in the model arguments, or lower max_gen_toks."
                )
            fitted.append(Request(request.index, request.doc[max(cut, 0) :], request.rest))
        return fitted

    def _compressed(self, requests: list[Request]) -> Iterator[tuple[Request, RaggedCache]]:
        """Each request with its document's compressed cache, compressing each distinct document once."""
        by_doc: dict[tuple[int, ...], list[Request]] = {}
        for request in requests:
            by_doc.setdefault(request.doc, []).append(request)
        for doc, group in by_doc.items():
            if doc:
                prompt = Prompt(torch.tensor([doc]), torch.tensor([group[0].rest]))
                cache = self.method.compress(self.session, prompt)
            else:
                cache = self.session.new_cache()
            self.compressions += 1
            for request in group:
                yield request, cache

    def _compresses_while_decoding(self, cache: RaggedCache) -> bool:
        """Whether the method's decoding context does anything (the base class's is a ``nullcontext``)."""
        return not isinstance(self.method.decode_context(self.session, copy.deepcopy(cache)), nullcontext)

    @torch.no_grad()
    def _score(
        self, cache: RaggedCache, rest: list[int], continuation: list[int], through_decoding: bool = False
    ) -> tuple[float, bool]:
        """(sum of log-probabilities, all greedy) of ``continuation`` after ``cache`` + ``rest``.

        ``cache`` is left untouched. ``through_decoding`` feeds the continuation one token at a time through
        the method's compression while decoding, when it has one.
        """
        if through_decoding and self._compresses_while_decoding(cache):
            decode = lambda c: self.method.decode_context(self.session, c)
            logprobs = self.session.forced_logprobs(cache, torch.tensor([rest]), continuation, decode)
            return float(logprobs.sum()), False  # rolling sums need no greedy flag
        logits = self.session.target_logits(cache, torch.tensor([rest]), continuation).double()
        logprobs = torch.log_softmax(logits, dim=-1)
        target = torch.tensor(continuation, device=logprobs.device)
        picked = logprobs.gather(1, target[:, None])[:, 0]
        return float(picked.sum()), bool((logprobs.argmax(-1) == target).all())
