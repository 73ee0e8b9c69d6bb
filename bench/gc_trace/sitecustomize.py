"""In each Python process of a benchmark mode (`bench/gpu_extract.py` puts this folder on PYTHONPATH for
them): with BENCH_POOL_MASK=1, the vLLM 0.26 pooling runner's step mask built in one comparison (below); with
BENCH_GC_TRACE naming a folder, every garbage-collector pass of 10 ms or more recorded, one line per pass,
"<epoch s> <generation> <ms> <collected>", in <folder>/gc-<pid>-<name>.log (for the flow's process, the
runner's and vLLM's engine core, so a pause in any of them can be lined up with the engine's timeline)."""

import os

if os.environ.get("BENCH_GC_TRACE"):
    import gc
    import sys
    import time

    _folder, _started = os.environ["BENCH_GC_TRACE"], [0.0]

    def _note(phase, info):
        if phase == "start":
            _started[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - _started[0]) * 1000
        if ms >= 10:
            name = os.path.basename(sys.argv[0] or "python") if sys.argv else "python"
            with open(os.path.join(_folder, f"gc-{os.getpid()}-{name}.log"), "a") as log:
                log.write(f"{time.time():.3f} {info['generation']} {ms:.1f} {info['collected']}\n")

    gc.callbacks.append(_note)


# With BENCH_POOL_MASK=1: vLLM 0.26.0's pooling model runner builds each step's finished-request mask by
# comparing 0-d tensors one request at a time (later releases compare whole tensors), some milliseconds of the
# engine core's loop per step of a thousand short prompts. Once its model runner is imported, `_pool` is
# replaced by the same method with the mask built in one comparison, so a flow run with and one without say
# what the per-request mask costs.
if os.environ.get("BENCH_POOL_MASK") == "1":
    import sys as _sys

    _TARGET = "vllm.v1.worker.gpu_model_runner"

    def _patch_pool(module):
        import vllm

        if vllm.__version__ != "0.26.0":
            return
        m = module

        def _pool(self, hidden_states, num_scheduled_tokens, num_scheduled_tokens_np, kv_connector_output):
            num_reqs = self.input_batch.num_reqs
            assert num_reqs == len(self.input_batch.pooling_params)
            hidden_states = hidden_states[:num_scheduled_tokens]
            seq_lens_cpu = self.optimistic_seq_lens_cpu[:num_reqs]
            pooling_metadata = self.input_batch.get_pooling_metadata()
            pooling_metadata.build_pooling_cursor(
                num_scheduled_tokens_np, seq_lens_cpu, device=hidden_states.device,
                query_start_loc_gpu=self.query_start_loc.gpu[: num_reqs + 1])
            raw_pooler_output = self.model.pooler(hidden_states=hidden_states, pooling_metadata=pooling_metadata)
            finished_mask = (seq_lens_cpu == pooling_metadata.prompt_lens).tolist()  # the one change
            raw_pooler_output = self.late_interaction_runner.postprocess_pooler_output(
                raw_pooler_output=raw_pooler_output, pooling_params=pooling_metadata.pooling_params,
                req_ids=self.input_batch.req_ids, finished_mask=finished_mask)
            model_runner_output = m.ModelRunnerOutput(
                req_ids=self.input_batch.req_ids.copy(), req_id_to_index=self.input_batch.req_id_to_index.copy(),
                kv_connector_output=kv_connector_output)
            if raw_pooler_output is None or not any(finished_mask):
                self._sync_device()
                model_runner_output.pooler_output = [None] * num_reqs
                return model_runner_output
            if not m.current_platform.is_cuda_alike():
                model_runner_output.pooler_output = m._copy_pooler_output_to_cpu(
                    raw_pooler_output=raw_pooler_output, finished_mask=finished_mask)
                self._sync_device()
                return model_runner_output
            return m.AsyncGPUPoolingModelRunnerOutput(
                model_runner_output=model_runner_output, raw_pooler_output=raw_pooler_output,
                finished_mask=finished_mask, async_output_copy_stream=self._get_or_create_async_output_copy_stream())

        module.GPUModelRunner._pool = _pool
        print(f"BENCH_POOL_MASK: vLLM's _pool replaced in process {os.getpid()}", file=_sys.stderr, flush=True)

    class _PatchOnImport:
        """Finds the model runner's module through the other finders and patches it once it has run."""

        def find_spec(self, name, path, target=None):
            if name != _TARGET:
                return None
            for finder in _sys.meta_path:
                if finder is not self and hasattr(finder, "find_spec"):
                    spec = finder.find_spec(name, path, target)
                    if spec is not None:
                        break
            else:
                return None
            run = spec.loader.exec_module

            def exec_module(module):
                run(module)
                _patch_pool(module)

            spec.loader.exec_module = exec_module
            return spec

    _sys.meta_path.insert(0, _PatchOnImport())
