print("launch_server placeholder")
