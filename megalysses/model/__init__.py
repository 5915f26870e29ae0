"""The GPT model (Llama architecture) built from the parallel layers."""
