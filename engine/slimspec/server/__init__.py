"""HTTP service of the engine: FastAPI app, schemas, protobuf bodies, routes."""
