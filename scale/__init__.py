"""What a bigger model needs, each behind its flag and applied once, at load
(model.load_model): the forward and the update never mention them.

    fsdp.py       --fsdp: the policy sharded over the ranks (FSDP2)
    recompute.py  --gradient-checkpointing: activations recomputed in the backward
    lora.py       --lora-rank: LoRA adapters on a frozen base (peft)
"""
