"""LoRA adapters: where each InferenceAdapter is held (placement) and keeping replicas told."""
