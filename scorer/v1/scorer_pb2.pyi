from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ScoreDocsRequest(_message.Message):
    __slots__ = ("prompt", "docs", "options", "instruction", "request_id", "prompt_token_ids")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    DOCS_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    INSTRUCTION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    docs: _containers.RepeatedCompositeFieldContainer[Doc]
    options: ScoreOptions
    instruction: str
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, prompt: _Optional[str] = ..., docs: _Optional[_Iterable[_Union[Doc, _Mapping]]] = ..., options: _Optional[_Union[ScoreOptions, _Mapping]] = ..., instruction: _Optional[str] = ..., request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Doc(_message.Message):
    __slots__ = ("id", "text", "token_ids")
    ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    id: str
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ScoreOptions(_message.Message):
    __slots__ = ("scheme", "template", "label_tokens", "label_token_ids", "score_mode", "truncate", "max_doc_tokens", "group_size", "top_n", "return_label_logprobs", "doc_special_tokens", "special_tokens", "prefix_cache", "cache_salt")
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    LABEL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LABEL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SCORE_MODE_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_FIELD_NUMBER: _ClassVar[int]
    MAX_DOC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    TOP_N_FIELD_NUMBER: _ClassVar[int]
    RETURN_LABEL_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DOC_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    scheme: str
    template: str
    label_tokens: _containers.RepeatedScalarFieldContainer[str]
    label_token_ids: _containers.RepeatedScalarFieldContainer[int]
    score_mode: str
    truncate: str
    max_doc_tokens: int
    group_size: int
    top_n: int
    return_label_logprobs: bool
    doc_special_tokens: str
    special_tokens: str
    prefix_cache: str
    cache_salt: str
    def __init__(self, scheme: _Optional[str] = ..., template: _Optional[str] = ..., label_tokens: _Optional[_Iterable[str]] = ..., label_token_ids: _Optional[_Iterable[int]] = ..., score_mode: _Optional[str] = ..., truncate: _Optional[str] = ..., max_doc_tokens: _Optional[int] = ..., group_size: _Optional[int] = ..., top_n: _Optional[int] = ..., return_label_logprobs: _Optional[bool] = ..., doc_special_tokens: _Optional[str] = ..., special_tokens: _Optional[str] = ..., prefix_cache: _Optional[str] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class DocScore(_message.Message):
    __slots__ = ("id", "index", "score", "label_logprobs", "doc_tokens", "truncated_tokens", "truncated_chars")
    ID_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    LABEL_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DOC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATED_CHARS_FIELD_NUMBER: _ClassVar[int]
    id: str
    index: int
    score: float
    label_logprobs: _containers.RepeatedScalarFieldContainer[float]
    doc_tokens: int
    truncated_tokens: int
    truncated_chars: int
    def __init__(self, id: _Optional[str] = ..., index: _Optional[int] = ..., score: _Optional[float] = ..., label_logprobs: _Optional[_Iterable[float]] = ..., doc_tokens: _Optional[int] = ..., truncated_tokens: _Optional[int] = ..., truncated_chars: _Optional[int] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "doc_tokens", "tokens_computed", "tokens_saved", "cached_prompt_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DOC_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SAVED_FIELD_NUMBER: _ClassVar[int]
    CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    doc_tokens: int
    tokens_computed: int
    tokens_saved: int
    cached_prompt_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., doc_tokens: _Optional[int] = ..., tokens_computed: _Optional[int] = ..., tokens_saved: _Optional[int] = ..., cached_prompt_tokens: _Optional[int] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_seconds", "tokenize_seconds", "forward_seconds", "total_seconds")
    QUEUE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    queue_seconds: float
    tokenize_seconds: float
    forward_seconds: float
    total_seconds: float
    def __init__(self, queue_seconds: _Optional[float] = ..., tokenize_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ..., total_seconds: _Optional[float] = ...) -> None: ...

class ScoreDocsResponse(_message.Message):
    __slots__ = ("results", "scheme", "usage", "timing", "model", "template", "request_id")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DocScore]
    scheme: str
    usage: Usage
    timing: Timing
    model: str
    template: str
    request_id: str
    def __init__(self, results: _Optional[_Iterable[_Union[DocScore, _Mapping]]] = ..., scheme: _Optional[str] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., model: _Optional[str] = ..., template: _Optional[str] = ..., request_id: _Optional[str] = ...) -> None: ...
