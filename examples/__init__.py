"""Example APIs for imgserve (docs/custom-api.md): each module is one a user would write and serve with
`imgserve serve --api examples.<module>:<Class>`."""
