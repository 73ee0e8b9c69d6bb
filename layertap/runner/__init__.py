"""Extraction engines behind one small interface (`base`): the hooked vLLM runner (`vllm_runner`, reaching
vLLM only through `vllm_seam`, capturing with `capture` and `pooler`), the transformers reference
(`hf_runner`), the runner in a process of its own (`runner_process`, `runner_client`, `runner_service`),
warm engines that outlive a run (`warm_engine`), Ray actors (`ray_cluster`, `ray_engines`), and the cache
that gives a process its runner (`engine_cache`)."""
