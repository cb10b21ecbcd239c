"""Built-in attack plugins; each module is one attack family."""
