"""LoRA adapters on sharded Wan experts: files and requests (:mod:`.files`), loading them into a
pipeline as diffusers does (:mod:`.load`), merging them before sharding (:mod:`.fuse`).
The per-layer rules (specs, live scales) are :mod:`wan_sharding.lora_layers`; the sharded
expert's side of diffusers' LoRA API is :mod:`wan_sharding.pipeline.lora`."""
