from posttrain.configs import config_reference

print(config_reference(), end="")
