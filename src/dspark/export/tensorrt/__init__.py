"""The ``tensorrt`` drafter backend: engine builds from the exported ONNX files, and the drafter
that runs them.

    python -m dspark.export --drafter CHECKPOINT --out OUT_DIR --trt --fp16 --batch 1,8,64 --past 1,1024,4096
    drafter = TensorRTDrafter.from_dir(OUT_DIR)        # a dspark.protocols.Drafter

* :mod:`dspark.export.tensorrt.profile` — the optimisation-profile ranges and precision of a build
  (:class:`~dspark.export.tensorrt.profile.EngineProfile`, the shipped presets);
* :mod:`dspark.export.tensorrt.environment` — whether TensorRT and CUDA can run here, its logger,
  :class:`~dspark.export.tensorrt.environment.TensorRTError`;
* :mod:`dspark.export.tensorrt.build` — :func:`~dspark.export.tensorrt.build.build_engines`, one
  serialized engine per exported graph;
* :mod:`dspark.export.tensorrt.runtime` — :class:`~dspark.export.tensorrt.runtime.TensorRTDrafter`
  and the runner executing its engines.

The ``tensorrt`` module itself is imported on first use (``import dspark.export.tensorrt.build``
does not import it). I/O stays fp32 for every precision, so the runtime is the same for all.

Failures are one sentence (:class:`~dspark.export.tensorrt.environment.TensorRTError`, an
:class:`~dspark.export.manifest.ExportError`): tensorrt missing or not importable, no CUDA, a
builder that cannot start, a parser error, a build that returns nothing, an engine that does not
deserialize (another TensorRT version or GPU), a shape outside the optimisation profile — with
TensorRT's own last logged error where there is one.
"""
