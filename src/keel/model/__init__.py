"""The Llama model, its loss, its split into pipeline stages, and its sizes (keel.model.flops, without torch)."""
