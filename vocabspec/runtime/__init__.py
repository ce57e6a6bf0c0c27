"""The runtime: the target model, its weight formats and loading, the KV caches, the backends that
run it (the native CPU engine, torch, the row-invariant kernels), the tokenizer and prompt formats."""
