"""Contract fakes of the engines the node agent drives: vLLM, SGLang, the LMCache controller, and NVML.

Each fake is written from the engine's public API (paths, query and body fields, status codes) and its
state machine, refuses what the engine refuses, and cites the engine source file of every rule. The
executor tests run against them as real HTTP servers (`serve.py`); `deploy/gpu/check_vllm.py` drives real
vLLM through the same executor, so a fake that drifts from the engine shows there.
"""
