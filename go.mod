module example.com/patterns/enterprise/outbox

go 1.26
