"""The Open Inference Protocol v2 (KServe v2 / Triton): HTTP (http.py) and gRPC (grpc_service.py) adapters onto
one model (model.py), which hands images to the same inference core as /predict; tensors.py is the request type."""
