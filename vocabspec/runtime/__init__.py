"""The engine: the target model, its weight formats and loading, the KV cache, the native CPU
engine and the row-invariant kernels, the tokenizer and prompt formats."""
