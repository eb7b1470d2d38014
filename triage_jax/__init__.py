"""triage-jax: stable low-precision RL for LLMs in JAX/Flax."""
