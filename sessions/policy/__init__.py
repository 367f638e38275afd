"""What an organisation sets for launches and placement: quotas, the images it offers, which projects may use which
resource group. Read by admission and by the scheduler alike."""
