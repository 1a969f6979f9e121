"""Code that runs inside vLLM's worker processes (never in the server's): ``vllm_plugin``
registers ``transfer_engine``, the weight-transfer engine that receives updates
(``worker_receive``), keeps the checkpoint copy deltas apply to (``checkpoint``,
``shared_copy``, ``patch_kernels``, ``heap``), shares it across tensor-parallel ranks
(``tp_share``) and reloads vLLM's weights (``reload_logs``); ``worker_extension`` is the worker
extension class vLLM loads."""
