"""What a run reports: one flat record per step from the stages' manifests (under TRL's
names where the meaning is the same), and the trackers it goes to (TensorBoard, MLflow,
Trackio, W&B)."""
