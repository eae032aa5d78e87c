"""ptrain.envs: environments (what a domain is) and the mixture over them."""
