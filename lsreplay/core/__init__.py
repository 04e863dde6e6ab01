"""The bottom layer, which every other imports and which imports nothing above it: a run's
config, its store (local or S3), its bookkeeping (directory, manifests, seeds), the stage
names and checkpoint folders, injected faults and the device locks."""
