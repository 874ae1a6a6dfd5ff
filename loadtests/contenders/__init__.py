"""The servers imgserve is measured against, each runnable on its own (`python -m loadtests.contenders.<name>
--port N`): a FastAPI endpoint as its users write one, and a plain LitServe API."""
