"""Built-in FedDG methods; each module is one method (Params, Server, Client)."""
