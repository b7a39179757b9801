"""Checkpoint I/O: Hugging Face directories (config.json + safetensors) and GGUF files, their tokenizers,
and the refusals for what the model cannot run faithfully. The model modules know nothing of files."""
