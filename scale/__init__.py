"""What a bigger model needs, each behind its flag.

    lora.py   LoRA adapters on a frozen base (--lora-rank; peft)
"""
