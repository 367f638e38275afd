"""What a launch must pass before it waits: quotas, presets, images, resource-group access, Idempotency-Key, the launch itself."""
