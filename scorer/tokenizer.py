"""The engine's fast tokenizer carried to a front-end process (``TokenizerSpec``) and rebuilt there
on the ``tokenizers`` library alone (``BackendTokenizer``): a front end then imports no
``transformers.AutoTokenizer``. On the 2-core VM a front end's start took 9.0 s and 358 MB with
it, 4.8 s and 283 MB without (``python -m bench.frontend_start``; torch is most of the rest). The spec
is the Rust backend exactly as transformers built it (``Tokenizer.to_str``: vocabulary, added
tokens, normalizer, pre-tokenizer, post-processor), so the ids are the engine's by construction;
what the wrapper adds (the unknown token, the default of ``split_special_tokens``) travels beside
it."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenizerSpec:
    backend: str = field(repr=False)  # the Rust backend's JSON
    unk_token: str | None
    unk_token_id: int | None
    split_special_tokens: bool = False  # the wrapper's default for ``encode``

    @classmethod
    def of(cls, tokenizer) -> TokenizerSpec | None:
        """The spec of a transformers tokenizer; None where its calls do more than its backend's
        (a slow tokenizer; truncation or padding set on the backend): a front end then loads it
        with transformers."""
        backend = getattr(tokenizer, "_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
        if backend is None or backend.truncation is not None or backend.padding is not None:
            return None
        return cls(
            backend.to_str(),
            tokenizer.unk_token,
            tokenizer.unk_token_id,
            bool(getattr(tokenizer, "split_special_tokens", False)),
        )


class BackendTokenizer:
    """What scoring calls of a transformers fast tokenizer (``scorer.request``), on its backend:
    ``encode`` as ``PreTrainedTokenizerFast.encode`` with no truncation or padding, and the
    vocabulary lookups."""

    is_fast = True

    def __init__(self, spec: TokenizerSpec) -> None:
        from tokenizers import Tokenizer

        self._tokenizer, self._split = (Tokenizer.from_str(spec.backend) for _ in range(2))
        self._tokenizer.encode_special_tokens = False  # each set once here: threads share both
        self._split.encode_special_tokens = True
        self.unk_token, self.unk_token_id = spec.unk_token, spec.unk_token_id
        self.split_special_tokens = spec.split_special_tokens

    @property
    def backend_tokenizer(self):
        return self._tokenizer

    @property
    def backends(self) -> tuple:
        """The backend encoding special-token strings as special tokens, and as text
        (``scorer.request.fast_backends``)."""
        return self._tokenizer, self._split

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        added = self._tokenizer.get_added_tokens_decoder()
        return {token.content: i for i, token in sorted(added.items())}

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(
        self, text: str, add_special_tokens: bool = True, split_special_tokens: bool | None = None
    ) -> list[int]:
        split = self.split_special_tokens if split_special_tokens is None else split_special_tokens
        backend = self._split if split else self._tokenizer
        return backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def convert_tokens_to_ids(self, token: str) -> int | None:
        index = self._tokenizer.token_to_id(token)
        return self.unk_token_id if index is None else index
