"""ONNX / TensorRT export of drafters (``python -m dspark.export``) — not implemented yet.

The export issue adds the backbone graph, the per-step sequential-head graph, the manifest and the
onnxruntime / tensorrt drafter backends here.
"""
