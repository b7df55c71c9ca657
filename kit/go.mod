module example.com/patterns/enterprise/outbox/kit

go 1.26.0
