"""The Open Inference Protocol v2 (KServe v2 / Triton), in the HTTP front-end processes: HTTP (http.py) and gRPC
(grpc_service.py, on the first front end) adapters onto one model (model.py), which hands images to the same
inference core as /predict; tensors.py is the request type both wire formats convert to."""
