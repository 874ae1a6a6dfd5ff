"""What the load tests and benchmarks are built from: starting servers, the closed-loop load generator, test
images, the in-process limit, scraping /metrics, reports and plots. Nothing here is a command."""
