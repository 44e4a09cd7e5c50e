"""Small command-line tools the scenario pack needs on machines that lack them."""
