"""The adapter to vLLM: ``vllm_engine`` (every call into vLLM's ``AsyncLLM``, and nothing else),
``engine_loop`` (vLLM's event loop and thread), ``engine_args`` (what vLLM starts with; pure),
``core_preload`` (the engine core's modules imported ahead), ``tokenizer_calls``,
``load_tracker`` (vLLM's stat logger), ``lifecycle_calls`` (vLLM's weight-transfer calls) and
``engine_logs`` (vLLM's logs and the causes they name)."""
