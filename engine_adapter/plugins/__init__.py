"""Plugins that put kvtier under outside engines: vLLM (`plugins.vllm`), SGLang
(`plugins.sglang`) and Hugging Face transformers (`plugins.hf`). Each is imported only when
chosen, so none of the engines is a dependency of kvtier."""
