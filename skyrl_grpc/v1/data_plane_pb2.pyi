from skyrl_grpc.v1 import chat_tools_pb2 as _chat_tools_pb2
from skyrl_grpc.v1 import generation_pb2 as _generation_pb2
from skyrl_grpc.v1 import lora_pb2 as _lora_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "n", "include_text", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TEXT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generation_pb2.SamplingParams
    n: int
    include_text: bool
    lora: str
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., n: _Optional[int] = ..., include_text: _Optional[bool] = ..., lora: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "samples", "usage", "prompt_logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    samples: _containers.RepeatedCompositeFieldContainer[_generation_pb2.Sample]
    usage: _generation_pb2.Usage
    prompt_logprobs: _generation_pb2.Logprobs
    def __init__(self, request_id: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[_generation_pb2.Sample, _Mapping]]] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., prompt_logprobs: _Optional[_Union[_generation_pb2.Logprobs, _Mapping]] = ...) -> None: ...

class GenerateStreamRequest(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "sampling_params", "n", "include_text", "stream_interval", "lora", "chat_output", "min_weight_version")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_TEXT_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    CHAT_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    MIN_WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling_params: _generation_pb2.SamplingParams
    n: int
    include_text: bool
    stream_interval: int
    lora: str
    chat_output: _chat_tools_pb2.ChatOutput
    min_weight_version: int
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., n: _Optional[int] = ..., include_text: _Optional[bool] = ..., stream_interval: _Optional[int] = ..., lora: _Optional[str] = ..., chat_output: _Optional[_Union[_chat_tools_pb2.ChatOutput, _Mapping]] = ..., min_weight_version: _Optional[int] = ...) -> None: ...

class GenerateStreamResponse(_message.Message):
    __slots__ = ("request_id", "sample_index", "token_ids", "logprobs", "finish_reason", "stop", "usage", "weight_version", "prompt_logprobs", "text", "lora_version", "chat_delta", "chat_message", "batch_index", "routed_experts")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LORA_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHAT_DELTA_FIELD_NUMBER: _ClassVar[int]
    CHAT_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    sample_index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _generation_pb2.Logprobs
    finish_reason: _generation_pb2.FinishReason
    stop: _generation_pb2.StopMatch
    usage: _generation_pb2.Usage
    weight_version: int
    prompt_logprobs: _generation_pb2.Logprobs
    text: str
    lora_version: int
    chat_delta: _chat_tools_pb2.ChatDelta
    chat_message: _chat_tools_pb2.ChatMessageOut
    batch_index: int
    routed_experts: _generation_pb2.RoutedExperts
    def __init__(self, request_id: _Optional[str] = ..., sample_index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Union[_generation_pb2.Logprobs, _Mapping]] = ..., finish_reason: _Optional[_Union[_generation_pb2.FinishReason, str]] = ..., stop: _Optional[_Union[_generation_pb2.StopMatch, _Mapping]] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., weight_version: _Optional[int] = ..., prompt_logprobs: _Optional[_Union[_generation_pb2.Logprobs, _Mapping]] = ..., text: _Optional[str] = ..., lora_version: _Optional[int] = ..., chat_delta: _Optional[_Union[_chat_tools_pb2.ChatDelta, _Mapping]] = ..., chat_message: _Optional[_Union[_chat_tools_pb2.ChatMessageOut, _Mapping]] = ..., batch_index: _Optional[int] = ..., routed_experts: _Optional[_Union[_generation_pb2.RoutedExperts, _Mapping]] = ...) -> None: ...

class GenerateBatchRequest(_message.Message):
    __slots__ = ("requests", "session_ids", "indices")
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SESSION_IDS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    requests: _containers.RepeatedCompositeFieldContainer[GenerateStreamRequest]
    session_ids: _containers.RepeatedScalarFieldContainer[str]
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, requests: _Optional[_Iterable[_Union[GenerateStreamRequest, _Mapping]]] = ..., session_ids: _Optional[_Iterable[str]] = ..., indices: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateBatchResponse(_message.Message):
    __slots__ = ("chunks", "errors")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[GenerateStreamResponse]
    errors: _containers.RepeatedCompositeFieldContainer[BatchError]
    def __init__(self, chunks: _Optional[_Iterable[_Union[GenerateStreamResponse, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[BatchError, _Mapping]]] = ...) -> None: ...

class GenerateMultiplexRequest(_message.Message):
    __slots__ = ("add", "cancel", "trace_context")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ADD_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    add: GenerateBatchRequest
    cancel: _containers.RepeatedScalarFieldContainer[int]
    trace_context: _containers.ScalarMap[str, str]
    def __init__(self, add: _Optional[_Union[GenerateBatchRequest, _Mapping]] = ..., cancel: _Optional[_Iterable[int]] = ..., trace_context: _Optional[_Mapping[str, str]] = ...) -> None: ...

class GenerateMultiplexResponse(_message.Message):
    __slots__ = ("chunks", "errors")
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    chunks: _containers.RepeatedCompositeFieldContainer[GenerateStreamResponse]
    errors: _containers.RepeatedCompositeFieldContainer[BatchError]
    def __init__(self, chunks: _Optional[_Iterable[_Union[GenerateStreamResponse, _Mapping]]] = ..., errors: _Optional[_Iterable[_Union[BatchError, _Mapping]]] = ...) -> None: ...

class BatchError(_message.Message):
    __slots__ = ("index", "code", "message")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    index: int
    code: int
    message: str
    def __init__(self, index: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content", "tool_calls", "tool_call_id", "name")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALL_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[_chat_tools_pb2.ToolCall]
    tool_call_id: str
    name: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[_chat_tools_pb2.ToolCall, _Mapping]]] = ..., tool_call_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ChatRequest(_message.Message):
    __slots__ = ("request_id", "messages", "sampling_params", "n", "add_generation_prompt", "lora", "tool_use")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    TOOL_USE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    sampling_params: _generation_pb2.SamplingParams
    n: int
    add_generation_prompt: bool
    lora: str
    tool_use: _chat_tools_pb2.ToolUse
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., n: _Optional[int] = ..., add_generation_prompt: _Optional[bool] = ..., lora: _Optional[str] = ..., tool_use: _Optional[_Union[_chat_tools_pb2.ToolUse, _Mapping]] = ...) -> None: ...

class ChatResponse(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "samples", "usage", "messages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[_generation_pb2.Sample]
    usage: _generation_pb2.Usage
    messages: _containers.RepeatedCompositeFieldContainer[_chat_tools_pb2.ChatMessageOut]
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[_generation_pb2.Sample, _Mapping]]] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ..., messages: _Optional[_Iterable[_Union[_chat_tools_pb2.ChatMessageOut, _Mapping]]] = ...) -> None: ...

class CompleteRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling_params", "n", "add_special_tokens", "lora")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    sampling_params: _generation_pb2.SamplingParams
    n: int
    add_special_tokens: bool
    lora: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., sampling_params: _Optional[_Union[_generation_pb2.SamplingParams, _Mapping]] = ..., n: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ..., lora: _Optional[str] = ...) -> None: ...

class CompleteResponse(_message.Message):
    __slots__ = ("request_id", "prompt_token_ids", "samples", "usage")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    samples: _containers.RepeatedCompositeFieldContainer[_generation_pb2.Sample]
    usage: _generation_pb2.Usage
    def __init__(self, request_id: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., samples: _Optional[_Iterable[_Union[_generation_pb2.Sample, _Mapping]]] = ..., usage: _Optional[_Union[_generation_pb2.Usage, _Mapping]] = ...) -> None: ...

class ChatConversation(_message.Message):
    __slots__ = ("messages", "add_generation_prompt", "tools")
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    add_generation_prompt: bool
    tools: _containers.RepeatedCompositeFieldContainer[_chat_tools_pb2.Tool]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ..., add_generation_prompt: _Optional[bool] = ..., tools: _Optional[_Iterable[_Union[_chat_tools_pb2.Tool, _Mapping]]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "conversation", "add_special_tokens")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CONVERSATION_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    text: str
    conversation: ChatConversation
    add_special_tokens: bool
    def __init__(self, text: _Optional[str] = ..., conversation: _Optional[_Union[ChatConversation, _Mapping]] = ..., add_special_tokens: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids",)
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...

class GetTokenizerRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetTokenizerResponse(_message.Message):
    __slots__ = ("tokenizer_json",)
    TOKENIZER_JSON_FIELD_NUMBER: _ClassVar[int]
    tokenizer_json: str
    def __init__(self, tokenizer_json: _Optional[str] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetModelInfoResponse(_message.Message):
    __slots__ = ("served_model_name", "vocab_size", "bos_token_id", "eos_token_ids", "pad_token_id", "max_context_length", "has_chat_template", "lora_adapters")
    SERVED_MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    BOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAD_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    served_model_name: str
    vocab_size: int
    bos_token_id: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    pad_token_id: int
    max_context_length: int
    has_chat_template: bool
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_lora_pb2.LoraAdapter]
    def __init__(self, served_model_name: _Optional[str] = ..., vocab_size: _Optional[int] = ..., bos_token_id: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., pad_token_id: _Optional[int] = ..., max_context_length: _Optional[int] = ..., has_chat_template: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[_Union[_lora_pb2.LoraAdapter, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class FinishSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class FinishSessionResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
