"""Lambda handlers of the platform's custom resources (each a function of one module, with
boto3 from the Lambda runtime; the folder is the functions' code asset). They run at deploy
and destroy time; their tests drive them with botocore's Stubber and recorded responses."""
