"""Low-rank adapters (peft's LoRA) on parallel models: placed like their base modules (``placement.py``),
watched for as peft adds and removes them, saved gathered (``seams.py``)."""
