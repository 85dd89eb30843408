"""Loading a GGUF model: the file (checked offsets), dequantisation, weights, model config,
tokenizer, chat template and the registry of packaged models. In: a path or a name; out: a LoadedModel."""
