"""The Open Inference Protocol v2 (KServe v2 / Triton), in the HTTP front-end processes: HTTP (http.py) and gRPC
(grpc_service.py, its stream in grpc_stream.py and what a call must pass in grpc_gate.py, on the first front end)
adapters onto one model (model.py), which hands images to the same inference core as /predict; tensors.py is the
request type both wire formats convert to; statistics.py reads the statistics extension's figures from the metrics."""
