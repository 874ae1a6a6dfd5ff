"""Load tests and benchmarks for imgserve: Locust users and shapes, capacity steps, the side-by-side benchmark."""
