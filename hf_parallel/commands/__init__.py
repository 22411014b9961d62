"""The hf-parallel commands: generate, plan, verify, consolidate, and the embedded default model they fall back to."""
